"""The compiler: front end (load, trace, annotate, coarsen, profile, split) and the CLI."""
