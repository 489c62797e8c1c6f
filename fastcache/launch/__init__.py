"""python -m fastcache.launch: a whole deployment on this machine, proven by a verifying workload.

cli (the command), harness (worker processes), verify (expected bytes), workload, liquid (resharding).
"""
