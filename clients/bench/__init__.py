"""The benchmark: `tokenstream bench` (cli.py) drives transports (transports.py) through a
workload (prompts.py, runner.py) and summarises (summary.py, with the definitions of
clients/library/metrics.py) into a report (report.py, plot.py); genai_perf.py reads genai-perf's
export; engine.py is `tokenstream engine-bench`, the in-process engine against Hugging Face
generate.
"""
