"""Knock adapters run from peft 0.20 (Axolotl 0.19's pin, CI's low end: kha_hf/peft/compat.py gives them peft
0.21's file format and load checks there) to the newest peft; this folder's tests run at both ends."""
