"""The surgery stage: the float64 weight edits a plan lists, β placement, calibration of
approximate norms, and verification against the original."""
