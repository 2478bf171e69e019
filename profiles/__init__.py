"""The shipped latency profiles (package data `dytc.profiles`; see dytc.latency.default_profiles)."""
