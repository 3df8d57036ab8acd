"""orchestr.roles: role actors (generator, trainer, reward, KV store, attention server, expert
host) over sans-IO state cores. The package exists so the layout installs whole; the roles are
built in their own issues and nothing here is exported yet."""

__all__: list[str] = []
