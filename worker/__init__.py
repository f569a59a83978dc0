"""The build fleet: RQ jobs that build wheels under supervision."""
