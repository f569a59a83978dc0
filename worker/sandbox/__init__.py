"""The build's sandbox: the bubblewrap wrapper and its uid slots and caps, safe file access to what
a build wrote, seccomp, and what runs inside it on hostile bytes.
"""
