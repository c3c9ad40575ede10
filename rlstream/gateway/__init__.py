"""The gateway: any agent program that calls an OpenAI-compatible API becomes training data (``rlstream gateway``).

- ``chat.py``: the OpenAI side of a call: chat messages through the policy's template, the engine's tokens kept
  across an episode's calls (never re-tokenized), the model's tool calls out as OpenAI ``tool_calls``;
- ``sessions.py``: calls grouped into episodes by session id, and a closed episode as Trajectory records;
- ``engine.py``: the policy engine behind the gateway (in process, or a fleet of servers), following new versions;
- ``writer.py``: closed episodes onto ``trajectories`` in Kafka transactions (a killed gateway writes nothing half);
- ``server.py``: the HTTP routes, the settings and the command;
- ``streaming.py``: ``"stream": true`` answers, the engine's tokens as server-sent events as they are sampled;
- ``reward.py``: ``posted``, the reward function that reads a reward posted with the close.
"""
