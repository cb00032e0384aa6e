"""The harness Hydra launcher (Hydra instantiates launchers only from the hydra_plugins package)."""
