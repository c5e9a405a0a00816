"""The console face: `kvprobe ledger | emulate | probe | profiles | shadow | worker`."""
