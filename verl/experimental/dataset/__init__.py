"""Experimental dataset interfaces (custom and curriculum samplers)."""
