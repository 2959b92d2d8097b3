"""Files build-runtime.py puts into a runtime (sandboxer.build): they run inside sandboxes, on the
runtime's own Python, and import nothing of sandboxer."""
