"""Launch profiles: the pydantic model, TOML loading (extends, --set), the sglang flag schema and rendering."""
