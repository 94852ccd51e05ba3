"""Capture of GDN entry points and FX passes that rewrite them into verify ops."""
