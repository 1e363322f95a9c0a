"""Costs, the draft-length policy and calibration: what k and the tree shape are chosen from."""
