"""The math of the programs: losses, KL terms, multipliers and advantage estimators."""
