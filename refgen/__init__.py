"""refgen"""
