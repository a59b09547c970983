"""The `trajstore` command line; each command is a thin shell over one library call."""
