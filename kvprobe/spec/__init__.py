"""The files a user writes: load profiles and expectations, validated on load (the first stage of a probe)."""
