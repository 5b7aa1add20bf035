"""gspo-trl's accelerations of one-token decoding steps on CPU: `linear`, `attention`, `forward`, `kernel`."""
