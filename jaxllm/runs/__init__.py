"""A run's checkpoints on disk: orbax saves, retention, atomic commits and restore onto any mesh
(`checkpoint`), and the checksum manifests that find corrupted checkpoint files before they load
(`checksums`).
"""
