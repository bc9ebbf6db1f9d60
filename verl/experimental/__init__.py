"""Features that compose core pieces in their own package (upstream verl keeps its agent loops here too)."""
