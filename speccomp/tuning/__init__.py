"""Choosing on this machine: self-drafter layer search, tree autotuning (Sequoia DP), heads training, bench."""
