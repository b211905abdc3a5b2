"""Small plain types the rest of kiln leans on."""
