"""What controller and worker both speak: errors, link shapes, the validation schema."""
