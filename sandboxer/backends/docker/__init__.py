"""Docker: one container per sandbox (container.py: the Engine's view, user-namespace remapping),
its rendering (render.py), and the Backend the core uses (backend.py)."""
