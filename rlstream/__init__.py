"""rlstream: a post-training RL runtime for LLMs as an asynchronous event-streaming pipeline on Kafka.

Folders by concept: kafka/ (every Kafka client), schemas/ (records and codec), runtime/ (the exactly-once stage
runtime), engine/ (inference engines: transformers, vLLM, server fleets; used by rollout, gateway and teacher),
stages/ (rollout, env, reward, teacher, replay), envs/ (environments), gateway/ (the OpenAI-compatible agent
gateway), policy/ (weights, versions, staleness), trainer/, models/, sources/ (prompts and tasks), rewards/
(reward functions), archive/ (ClickHouse), monitoring/ (the faust monitor), sandbox/ (untrusted code: the
subprocess and docker backends), infra/ (broker and supervisor). cli.py is the command line; config.py the
typed settings; errors.py the errors a user is told how to fix; metrics.py the Prometheus metrics every process
serves.
"""
