"""Model card templates, one per model_type (installed as package data of hf_hybrid.model_cards)."""
