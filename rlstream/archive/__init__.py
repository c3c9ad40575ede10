"""The archive: every topic of a run in ClickHouse (embedded chDB or a server).

One definition per table (its DDL, its row mapping and its SQL mapping), the
sink that inserts idempotently, SQL access and the endpoint other processes
query through, the standard views, the HTML report, and the source that
rebuilds archived trajectories for replay.
"""
