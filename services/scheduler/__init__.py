"""Scheduler + block manager stage."""
