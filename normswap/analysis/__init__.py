"""The analysis stage: trace one forward pass, find the norms, follow each norm's stream to its
writers and readers, and decide a verdict and the edits for each (the plan)."""
