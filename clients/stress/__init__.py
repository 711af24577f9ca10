"""`tokenstream stress`: many concurrent tritonclient requests, and what operators watch.

load.py sends the requests, server_stats.py reads what Triton saw (statistics, metrics, memory),
report.py sets the figures beside the reference ranges, cli.py is the command.
"""
