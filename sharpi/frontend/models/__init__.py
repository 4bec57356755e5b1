"""One file per architecture family whose graph composes frontend.blocks in its own way (frontend.architectures
says which builds which)."""
