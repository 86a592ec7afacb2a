"""abkit: the A/B suite's pieces (bench/ab_suite.py); none imports vLLM or torch at import time."""
