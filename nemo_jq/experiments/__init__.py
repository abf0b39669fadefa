"""Experiments: multi-run studies users run in one command (not tests)."""
