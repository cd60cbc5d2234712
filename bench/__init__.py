"""`python -m bench`: the main job, a correctness and speed table for every component."""
