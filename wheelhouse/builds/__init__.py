"""What a build is and how it travels: the spec, the job and its metadata, the queue, fan-out, the
fleet's adverts, the torch index, MAX_JOBS, a build's facts, counters, and project directories
as sdists.
"""
