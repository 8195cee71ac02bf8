"""Vision towers (SigLIP, CLIP) and the connectors that turn their patch features into decoder embeddings."""
