pytest_plugins = ["mineonline_core.testing.fixtures"]
