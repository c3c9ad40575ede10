"""The faust monitor: windowed per-version figures computed from the topics of a running loop, served over HTTP
(`rlstream run monitor`), with a plain consumer as its fallback where faust is not installed.
"""
