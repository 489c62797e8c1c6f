"""Operator tools, run as python -m fastcache.tools.<name>."""
