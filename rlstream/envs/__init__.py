"""Environments: what answers a model's action with the next observation, and the parts they run on.

- ``api.py``: the plugin interface (``make(task, workspace) -> Env`` with ``reset``, ``step``, ``close``), the
  step result, the failure classes, loading a plugin by dotted path;
- ``builtin.py``: the stateless built-ins by ``task.env_name`` (``single``, ``calculator``, ``python``);
- ``workspace.py``: an episode's directory inside the sandbox, and the shell and file tools that work in it;
- ``session.py``: the episode's persistent sandbox, so processes a step starts run on at the next step;
- ``docker_session.py``: the same under the docker sandbox: one container per episode, each call exec'd into it;
- ``tools.py``: tool calls parsed from the model's text, and the built-in ``tools`` env (shell and file tools);
- ``live.py``: the envs of the episodes in flight, one per episode, with timeouts and rebuild-by-replay;
- ``remote.py`` / ``server.py``: the same interface over HTTP (``--env-url`` / ``rlstream env-server``), and the
  retry of a task whose env server could not be reached.

The env stage (``rlstream/stages/env.py``) is decode -> handle -> encode over these.
"""
