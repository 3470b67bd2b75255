"""The NIXL transport: worker threads owning agents, and the start-up self-check."""
