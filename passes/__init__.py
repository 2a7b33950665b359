"""Graph rewrites on captured speccomp graphs. Each pass is a `speccomp.frontend.graph.Pass`."""
