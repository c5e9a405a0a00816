"""What a probe measures: an emulated, launched, attached, shadow or fleet engine, behind one interface."""
