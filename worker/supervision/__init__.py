"""Supervising a running build: the runner, the reaper of its process tree, cgroups, the memory
governor and the build log.
"""
