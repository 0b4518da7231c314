"""One training step over the parallel model, without Lightning: the encoder stage, the pipeline runner and the
step's loss."""
