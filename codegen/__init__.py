"""Turning IR objects into files: stage source, handlers, manifests, report."""
