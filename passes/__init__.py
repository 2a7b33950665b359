"""Graph rewrites on captured speccomp graphs. Each pass is a `speccomp.graph.Pass`."""
