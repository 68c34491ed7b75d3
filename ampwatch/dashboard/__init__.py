"""Query helpers and figures for the dashboard app."""
