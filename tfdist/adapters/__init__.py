"""One module per strategy, all on `tfdist.adapters.base.Adapter`.

The registry imports each on first use; nothing here imports them all.
"""
