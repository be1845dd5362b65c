"""Build plans (TOML) and the device catalog; read by builder.planning.plan."""
