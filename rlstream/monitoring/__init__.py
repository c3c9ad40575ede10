"""What a running loop tells people: Prometheus metrics of every process, and the faust monitor that
computes windowed per-version figures from the topics.
"""
