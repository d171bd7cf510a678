"""sm90 flash attention in Pallas Mosaic GPU."""
