"""The sandbox runtime: where a task's commands run (bubblewrap sandboxes, terminals, images, Python environments, prepared workspaces)."""
